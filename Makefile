# tta: set-up and entry points. Every target is idempotent and incremental: a second
# `make test` on a ready tree only runs the tests.
#
#   make demo    set up (first time) and run the demo: bag -> three ROS 2 nodes -> report
#   make test    set up (first time) and run the test suite (every tier: unit, ros, system)
#   make test-fast  test/unit without `slow` (tta_core and kernels: no ROS, no CLI/colcon runs)
#   make setup   only set up: .venv, pinned wheels, tta_msgs built, build/env.sh
#   make lint    ruff over the Python sources, lint-imports over the contracts in .importlinter
#   make docs    build the docs site into build/site (mkdocs --strict; reference pages:
#                python scripts/gen_docs.py)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build
PREFIX := $(CURDIR)/$(BUILD)/install
ENV    := $(BUILD)/env.sh
MSGS   := $(wildcard msg/msg/*.msg)

.PHONY: setup demo test test-fast lint docs clean
.DELETE_ON_ERROR:

setup: $(ENV)

$(VENV)/.deps: requirements/base.txt requirements/python.txt requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --disable-pip-version-check \
		-r requirements/base.txt -c requirements/constraints.txt
	touch $@

$(VENV)/.tta: $(VENV)/.deps ros_package/setup.py ros_package/setup.cfg ros_package/package.xml
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e ros_package
	touch $@

$(BUILD)/.tta_msgs: $(VENV)/.deps msg/CMakeLists.txt msg/package.xml $(MSGS)
	AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(VENV)/bin:$$PATH \
		cmake -S msg -B $(BUILD)/tta_msgs -Wno-dev --log-level=WARNING \
		-DCMAKE_PREFIX_PATH=$(CURDIR)/$(VENV) -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
		-DCMAKE_INSTALL_PREFIX=$(PREFIX) -DBUILD_TESTING=OFF
	cmake --build $(BUILD)/tta_msgs -j 2 -- --no-print-directory >/dev/null
	cmake --install $(BUILD)/tta_msgs >/dev/null
	touch $@

$(ENV): $(VENV)/.tta $(BUILD)/.tta_msgs scripts/write_env.py
	$(PY) scripts/write_env.py --venv $(VENV) --prefix $(PREFIX) --out $@
	$(PY) -c "from tta_kernels import native; native.main()"  # DAF's C kernels (cached)
	touch $(BUILD)/COLCON_IGNORE  # a colcon workspace holding this checkout skips our build

demo: $(ENV)
	. ./$(ENV) && tta demo

test: $(ENV)
	. ./$(ENV) && python -m pytest

test-fast: $(ENV)
	. ./$(ENV) && python -m pytest test/unit -q -m "not slow"

lint: $(ENV)
	. ./$(ENV) && ruff check . && lint-imports

docs: $(ENV)
	. ./$(ENV) && NO_MKDOCS_2_WARNING=1 mkdocs build --strict

clean:
	rm -rf $(BUILD) $(VENV) *.egg-info ros_package/*.egg-info
