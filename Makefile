# The two set-up commands of the README: `make chat` and `make test`.
.PHONY: chat test setup lint bench

.venv/.kvchat-installed: pyproject.toml scripts/setup.sh
	./scripts/setup.sh

setup: .venv/.kvchat-installed

chat: setup
	.venv/bin/kvchat

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .

bench: setup
	.venv/bin/kvchat bench --json bench-results/bench.json
