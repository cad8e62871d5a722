import contextlib
import io
import os
import tempfile

from textstats.cli import main
from textstats.report import report


def test_report_lines():
    text = report("one two two", top=1)
    assert text.splitlines() == ["words: 3", "distinct: 2", "mean length: 3.00", "  two: 2"]


def test_cli_top_option():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "notes.txt")
        with open(path, "w") as f:
            f.write("a b b c c c")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main([path, "--top", "1"])
    assert out.getvalue().strip().splitlines()[-1] == "  c: 3"
