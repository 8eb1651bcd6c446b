. runs/scalebench/env.sh
/usr/bin/time -v $B --pairs 0,1,2 --others 2000 --tpe 200 --out runs/scalebench/p64/results.json
/usr/bin/time -v $B --pairs 5 --others 500 --tpe 50 --out runs/scalebench/p256/results.json
