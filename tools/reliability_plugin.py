"""pytest plugin for tools/reliability_report.py: records every test's outcome
and what tests hand to `record_property` under the names "fa_compare" ((error,
tolerance) of one comparison with the reference), "fa_bad_input" ((defect,
exception type)) and "fa_measure" (a dict of measurements), then writes them
as JSON to $FASTATTN_RELIABILITY_JSON at the end of the session.

Load it with:  PYTHONPATH=tools pytest -p reliability_plugin
"""
import json
import os
import time

_tests = {}      # nodeid -> outcome ("passed", "failed", "skipped")
_compares = []   # [nodeid, error, tolerance]
_bad_inputs = []  # [nodeid, defect, exception type]
_measures = []   # [nodeid, {name: value}]
_start = time.time()


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.when == "call" or report.outcome != "passed":
        # a failure or skip in setup/teardown decides the outcome too
        if _tests.get(nodeid) != "failed":
            _tests[nodeid] = report.outcome
    elif nodeid not in _tests:
        _tests[nodeid] = "pending"
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == "fa_compare":
            err, tol = value
            _compares.append([nodeid, float(err), float(tol)])
        elif name == "fa_bad_input":
            defect, exc = value
            _bad_inputs.append([nodeid, str(defect), str(exc)])
        elif name == "fa_measure":
            _measures.append([nodeid, dict(value)])


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FASTATTN_RELIABILITY_JSON")
    if not path:
        return
    data = {
        "exitstatus": int(exitstatus),
        "seconds": time.time() - _start,
        "tests": _tests,
        "compares": _compares,
        "bad_inputs": _bad_inputs,
        "measures": _measures,
    }
    with open(path, "w") as f:
        json.dump(data, f)
