"""Several cases of one tests/mp script in one horovodrun job (launch.case_output):

    python tests/mp/cases.py <script.py> '<JSON list of cases>'

calls the script's ``main(case)`` for each case in turn (``main(*case)`` where a case is a list:
several arguments). Every line a case prints goes out as it
is written, with ``case <i>: `` before it, and a case that raises prints its traceback there and
the next case runs: each test reads its own case's lines. A case that leaves a collective
unmatched hangs the job, and the launcher's timeout then fails every case of it, the output so
far showing which case stopped."""
import contextlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path


class Tagged:
    """A stdout that writes each whole line with its case's tag."""

    def __init__(self, out, tag: str):
        self.out, self.tag, self.part = out, tag, ""

    def write(self, text: str) -> int:
        *lines, self.part = (self.part + text).split("\n")
        for line in lines:
            self.out.write(f"{self.tag}{line}\n")
        self.out.flush()
        return len(text)

    def flush(self) -> None:
        if self.part:
            self.write("\n")


def main(script: str, cases: list) -> None:
    spec = importlib.util.spec_from_file_location(Path(script).stem, Path(__file__).with_name(script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for i, case in enumerate(cases):
        tagged = Tagged(sys.stdout, f"case {i}: ")
        with contextlib.redirect_stdout(tagged):
            try:
                module.main(*case) if isinstance(case, list) else module.main(case)
            except Exception:
                traceback.print_exc(file=sys.stdout)
            tagged.flush()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
