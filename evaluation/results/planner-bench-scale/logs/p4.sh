. runs/scalebench/env.sh
/usr/bin/time -v $B --pairs 4,3 --only sa200,random200 --others 2000 --tpe 200 --reuse runs/scalebench/p128/results.json --out runs/scalebench/p128b/results.json
/usr/bin/time -v $B --pairs 5,6 --only sa200,random200,tpe --others 2000 --tpe 200 --reuse runs/scalebench/p256/results.json,runs/scalebench/p512/results.json --out runs/scalebench/p256b/results.json
