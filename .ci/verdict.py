"""CI's verdict on a pytest run beside pytest's exit status: a run proves something only if tests ran.

    python .ci/verdict.py JUNIT_XML [--allow-skip PREFIX]...

Exit 1, with one line on stderr, when the report holds no test, when every test was skipped, or when a test
was skipped for a reason that does not start with an allowed prefix (CI provides every tool the tests use, so
the only acceptable skip is a test that needs hardware CI lacks). Otherwise prints the counts, exit 0.
Standard library only: it runs before and outside the package's environment.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def verdict(junit: str, allowed: list[str]) -> tuple[bool, str]:
    """(passed, one line) for the junit XML report at `junit`."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as err:
        return False, f"ci: no readable test report ({err})"
    cases = list(root.iter("testcase"))
    skipped = [(case, case.find("skipped")) for case in cases if case.find("skipped") is not None]
    if not cases:
        return False, "ci: no test ran (none collected)"
    if len(skipped) == len(cases):
        return False, f"ci: every one of the {len(cases)} tests was skipped: nothing was tested"
    unexpected = [(case, s) for case, s in skipped if not (s.get("message") or "").startswith(tuple(allowed))]
    if unexpected:
        case, s = unexpected[0]
        return False, (f"ci: {len(unexpected)} tests skipped for a reason CI must not have, e.g. "
                       f"{case.get('classname')}::{case.get('name')}: {s.get('message')}")
    return True, f"ci: {len(cases) - len(skipped)} tests ran, {len(skipped)} skipped (allowed: {', '.join(allowed)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--allow-skip", action="append", default=[], metavar="PREFIX")
    args = parser.parse_args(argv)
    ok, line = verdict(args.junit, args.allow_skip)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
