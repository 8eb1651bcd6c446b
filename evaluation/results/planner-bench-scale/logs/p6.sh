. runs/scalebench/env.sh
/usr/bin/time -v $B --pairs 0,1,2,3,4,7,8 --seed 1 --only gnn50 --out runs/scalebench/seed1/results.json
/usr/bin/time -v $B --pairs 5,6 --seed 1 --only gnn50 --gnn-max-devices 512 --out runs/scalebench/seed1-coarse/results.json
