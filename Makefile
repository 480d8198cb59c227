# The two commands: `make run` serves the lab, `make test` runs every test.
PYTHON ?= python3
VENV := .venv

.PHONY: run test screenshots install install-dev bench clean

$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed
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
