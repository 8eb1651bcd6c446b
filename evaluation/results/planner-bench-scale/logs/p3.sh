. runs/scalebench/env.sh
/usr/bin/time -v $B --pairs 7,8 --others 2000 --tpe 200 --out runs/scalebench/p-more/results.json
