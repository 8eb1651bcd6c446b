export PYTHONPATH=. HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1 TAG_CACHE_DIR=/work/wt/scalebench/runs/scalebench/cache
B=".venv/bin/python -m evaluation.planner_bench --scale --pipelines auto --big 2000"
