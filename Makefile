# The two commands: `make run` serves the lab, `make test` runs every test.
PYTHON ?= python3
VENV := .venv

.PHONY: run test screenshots install install-dev bench clean bubblewrap

$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

# Debian's bubblewrap jails the code environment's candidate programs (rlcore/sandbox.py);
# installed the way scripts/test.sh installs chromium for the browser tests.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  echo "bubblewrap: installing Debian's bubblewrap for the code environment's sandbox"; \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; \
	  else \
	    sudo apt-get install -y -q bubblewrap >/dev/null; \
	  fi; }

install: $(VENV)/.installed bubblewrap
install-dev: $(VENV)/.installed-dev

run: install
	scripts/run.sh

test: install-dev
	scripts/test.sh

# Re-take the README's screenshots (the browser tests, writing into docs/screenshots).
screenshots: install-dev
	SCREENSHOTS_DIR=$(CURDIR)/docs/screenshots scripts/test.sh -m browser tests/browser

bench: install-dev
	$(VENV)/bin/python bench/local_engine.py
	$(VENV)/bin/python bench/tictactoe_mastery.py

clean:
	rm -rf var runs .pytest_cache
