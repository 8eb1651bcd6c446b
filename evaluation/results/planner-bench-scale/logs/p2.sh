. runs/scalebench/env.sh
/usr/bin/time -v $B --pairs 4,3 --others 1000 --tpe 200 --out runs/scalebench/p128/results.json
/usr/bin/time -v $B --pairs 6 --others 500 --tpe 50 --out runs/scalebench/p512/results.json
