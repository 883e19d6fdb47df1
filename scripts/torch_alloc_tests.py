#!/usr/bin/env python3
"""Run PyTorch's own allocator tests (a selection of its test/test_cuda.py) with one allocator.

    torch_alloc_tests.py TEST_FILE native|gpumem [--json OUT] [-k SUBSTRING]
    torch_alloc_tests.py --compare NATIVE.json GPUMEM.json

TEST_FILE is PyTorch's test_cuda.py, or a selection of its allocator classes (the GPU bundle
carries one: gpu-bundle/torch-tests/test_cuda.py; it is not part of this repository). With
`gpumem`, gpumem is installed as PyTorch's allocator (`gpumem_torch.install()`) before the test
module is imported, as the module's helpers touch CUDA at import. Each allocator runs in a
process of its own. Prints one line per test (PASS, FAIL, ERROR, SKIP, XFAIL) and the counts;
`--json` writes {"setting", "counts", "tests": {name: outcome}, "messages": {name: text}}.
`--compare` lists the tests that pass natively and not with gpumem, and fails (exit 1) if one
of them is not among the documented exceptions (DIFFERENT below, and the README).
Nothing is fetched: expecttest (which PyTorch's test helpers import) must be importable.
"""

import argparse
import importlib.util
import json
import os
import sys
import time
import unittest


# Tests that pass natively and not with gpumem because gpumem deliberately behaves otherwise:
# name -> why. The README's table of PyTorch's own tests gives the same list.
DIFFERENT = {}


def compare(native_json, gpumem_json):
    with open(native_json) as f:
        native = json.load(f)
    with open(gpumem_json) as f:
        gpumem = json.load(f)
    print("native: " + ", ".join(f"{k} {v}" for k, v in sorted(native["counts"].items())))
    print("gpumem: " + ", ".join(f"{k} {v}" for k, v in sorted(gpumem["counts"].items())))
    lost = [
        n
        for n, o in sorted(native["tests"].items())
        if o == "PASS" and gpumem["tests"].get(n) != "PASS"
    ]
    bad = 0
    for n in lost:
        why = DIFFERENT.get(n)
        if why is None:
            bad += 1
        print(f"{'known ' if why else 'LOST  '} {n}: {gpumem['tests'].get(n, 'not run')}"
              + (f" ({why})" if why else ""))
    print(f"passing natively: {sum(o == 'PASS' for o in native['tests'].values())}; "
          f"also with gpumem: {sum(o == 'PASS' for o in native['tests'].values()) - len(lost)}; "
          f"lost: {len(lost)} ({bad} not documented)")
    return 1 if bad else 0


class Recorder(unittest.TextTestResult):
    """Keeps each test's outcome and, for failures, the last lines of the traceback."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self.messages = {}
        self.started = 0.0

    def _name(self, test):
        return test.id().split(".", 1)[-1]

    def startTest(self, test):
        self.started = time.time()
        super().startTest(test)

    def _note(self, test, outcome, text=None):
        name = self._name(test)
        self.outcomes[name] = outcome
        if text:
            self.messages[name] = "\n".join(text.strip().splitlines()[-12:])
        print(f"{outcome:<6} {name} ({time.time() - self.started:.1f} s)", flush=True)
        if text and outcome in ("FAIL", "ERROR"):
            print("       " + self.messages[name].replace("\n", "\n       "), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "PASS")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "FAIL", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "ERROR", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "SKIP", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "XFAIL")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "FAIL", "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            outcome = "FAIL" if issubclass(err[0], test.failureException) else "ERROR"
            self._note(test, outcome, self._exc_info_to_string(err, test))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file")
    ap.add_argument("setting", choices=["native", "gpumem"])
    ap.add_argument("--json")
    ap.add_argument("-k", default="", help="run only tests whose name contains this")
    a = ap.parse_args()

    # (PyTorch's test case appends a "to execute this test, run ..." note to every failure)
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    if a.setting == "gpumem":
        import gpumem_torch

        gpumem_torch.install()
    spec = importlib.util.spec_from_file_location("test_cuda", a.test_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_cuda"] = module
    spec.loader.exec_module(module)

    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    if a.k:
        def keep(s):
            out = unittest.TestSuite()
            for t in s:
                if isinstance(t, unittest.TestSuite):
                    out.addTests(keep(t))
                elif a.k in t.id():
                    out.addTest(t)
            return out

        suite = keep(suite)
    runner = unittest.TextTestRunner(
        resultclass=Recorder, verbosity=0, stream=open(os.devnull, "w")
    )
    result = runner.run(suite)
    counts = {}
    for outcome in result.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"{a.setting}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "setting": a.setting,
                    "counts": counts,
                    "tests": result.outcomes,
                    "messages": result.messages,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
