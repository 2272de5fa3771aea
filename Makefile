.PHONY: run test setup
setup:
	bash scripts/setup.sh
run:
	bash scripts/run.sh
test:
	bash scripts/test.sh
