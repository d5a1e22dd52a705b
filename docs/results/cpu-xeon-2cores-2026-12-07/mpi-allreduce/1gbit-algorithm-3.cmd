.venv/bin/python -m redsync_hvd.experiments.netbench mpi-allreduce --bandwidth-mbit 1000 --mb 72 --repeats 8 --mca coll_tuned_use_dynamic_rules=1 --mca coll_tuned_allreduce_algorithm=3
