# Two commands on a fresh machine: `make train` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision are pinned to the releases this project is tested with; override
# TORCH= to use another build (e.g. a CUDA wheel index on a cluster).
TORCH ?= torch==2.14.1 torchvision==0.29.1
# The pip-installable MPI; set MPI_EXTRA= on a cluster whose MPI mpi4py was built against.
MPI_EXTRA ?= mpich,
STAMP := $(VENV)/.installed
NP ?= 2
TRAIN_ARGS ?= --model resnet18 --num-classes 10 --image-size 2048 --batch-size 2 \
              --stages 2 --schedule mast --steps 3

.PHONY: install train test gpu-check clean

$(STAMP): setup.py Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[$(MPI_EXTRA)test]'
	touch $(STAMP)

install: $(STAMP)

train: install
	$(VENV)/bin/mpiexec -n $(NP) $(VENV)/bin/gems-train $(TRAIN_ARGS)

# Two pytest workers (pytest-xdist), whole test files to a worker, so both cores stay busy while a
# test waits on a launch; tests/conftest.py orders the files (the longest first) and gives each worker
# one torch thread. tests/test_faults.py and tests/test_slurm.py run beside them in a third pytest of
# their own, mostly asleep (survivors in their timeouts, Slurm starting and requeueing jobs: ~1 minute
# of CPU in ~3-5 of wall time), their output shown after the rest. Their timings (a killed launch's
# processes gone within a minute, a Slurm job signalled while it trains) have been missed under the
# workers' load, so the workers run at a lower priority (nice): those launches get a core whenever
# they ask, the workers the rest.
test: install
	@log=$$(mktemp); \
	$(PY) -m pytest -q tests/test_faults.py tests/test_slurm.py >"$$log" 2>&1 & beside=$$!; \
	trap 'kill $$beside 2>/dev/null; rm -f "$$log"' INT TERM; \
	nice -n 10 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 \
	    --ignore tests/test_faults.py --ignore tests/test_slurm.py tests; workers=$$?; \
	wait $$beside; alone=$$?; \
	echo "--- tests/test_faults.py tests/test_slurm.py (run beside the rest) ---"; cat "$$log"; rm -f "$$log"; \
	[ $$workers -eq 0 ] && [ $$alone -eq 0 ]

# The GPU acceptance run, for a GPU machine without network: the Python found there (its own
# torch, 2.11 or later, mpi4py, pytest), nothing installed from an index. WHEELS=DIR installs the
# wheel files in DIR (e.g. mpich and mpi4py, where mpi4py finds no MPI library; see README "GPU
# check") under a private prefix: its site-packages go on PYTHONPATH, its mpiexec launches the
# ranks and MPI4PY_LIBMPI names its libmpi (pip --target would drop the wheel's lib/ folder).
GPU_PY ?= python3
WHEELS ?=
GPU_PREFIX := /tmp/gems-gpu-wheels
GPU_REPORT ?= gpu-check-report.md
GPU_CHECK_ARGS ?=
gpu-check:
ifneq ($(WHEELS),)
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --prefix $(GPU_PREFIX) $(WHEELS)/*.whl
	site=$$($(GPU_PY) -c 'import sysconfig; \
	    print(sysconfig.get_path("purelib", vars={"base": "$(GPU_PREFIX)", "platbase": "$(GPU_PREFIX)"}))') && \
	PYTHONPATH=$$site$${PYTHONPATH:+:$$PYTHONPATH} GEMS_MPIEXEC=$(GPU_PREFIX)/bin/mpiexec \
	    MPI4PY_LIBMPI=$(GPU_PREFIX)/lib/libmpi.so.12 \
	    $(GPU_PY) benchmarks/gpu_check.py --report $(GPU_REPORT) $(GPU_CHECK_ARGS)
else
	$(GPU_PY) benchmarks/gpu_check.py --report $(GPU_REPORT) $(GPU_CHECK_ARGS)
endif

clean:
	rm -rf $(VENV) *.egg-info
