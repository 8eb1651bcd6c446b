. runs/scalebench/env.sh
R=runs/scalebench
/usr/bin/time -v $B --pairs 0,1,2,3,4,7,8 --only gnn50 --checkpoint evaluation/results/planner-bench-retrained/predictor-retrained.pt --reuse $R/p64/results.json,$R/p128b/results.json,$R/p-more/results.json --out $R/retrained/results.json
/usr/bin/time -v $B --pairs 5,6 --only gnn50 --gnn-max-devices 512 --reuse $R/p256/results.json,$R/p512/results.json,$R/p256b/results.json --out $R/gnn-coarse/results.json
