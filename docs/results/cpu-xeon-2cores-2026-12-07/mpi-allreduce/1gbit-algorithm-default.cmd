.venv/bin/python -m redsync_hvd.experiments.netbench mpi-allreduce --bandwidth-mbit 1000 --mb 72 --repeats 8 
