# The two commands: `make run` serves the lab, `make test` runs every test.
PYTHON ?= python3
VENV := .venv

.PHONY: run test screenshots install install-dev bench clean bubblewrap chromium

$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

# apt_install(command, package, purpose): Debian's package, when its command is missing.
define apt_install
	@command -v $(1) >/dev/null 2>&1 || { \
	  echo "$(2): installing Debian's $(2) $(3)"; \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q $(2) >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $(2) >/dev/null; }; \
	  else \
	    sudo apt-get install -y -q $(2) >/dev/null; \
	  fi; }
endef

# Debian's bubblewrap jails the code environment's candidate programs (rlcore/sandbox.py).
bubblewrap:
	$(call apt_install,bwrap,bubblewrap,for the code environment's sandbox)

# Debian's chromium runs the browser environment's episodes through Playwright
# (rlcore/envs/browser_session.py; CHROMIUM_PATH names another binary) and the browser tests.
chromium:
	$(call apt_install,chromium,chromium,for the browser environment)

install: $(VENV)/.installed bubblewrap chromium
# `make test` needs what `make run` does: the sandbox and browser tests run the real jail and browser.
install-dev: $(VENV)/.installed-dev bubblewrap chromium

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
