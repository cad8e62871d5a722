"""Native output (written to fd 1/2 by C code or a child process) lands in the log file."""
import os
import subprocess
import sys

from infercourse.ops.logs import native_logs_to_file


def test_fd_level_output_goes_to_the_file_and_descriptors_come_back(tmp_path, capfd):
    log = tmp_path / "native.log"
    with native_logs_to_file(log, block=True):
        os.write(2, b"ggml: 1500 lines of quantize log\n")          # what C code does
        subprocess.run([sys.executable, "-c", "print('child stdout')"], check=True)  # inherits fd 1
    os.write(2, b"after\n")
    text = log.read_text()
    assert "ggml: 1500 lines" in text and "child stdout" in text and "after" not in text
    out, err = capfd.readouterr()
    assert "ggml" not in err and "child stdout" not in out and "after" in err


def test_import_time_python_chatter_goes_to_the_file_not_the_cell(tmp_path):
    """torchao and torch's pytree log through Python's `sys.stderr` object (the notebook's
    cell), above the descriptors: those loggers write to the same file instead."""
    log, seen = tmp_path / "native.log", tmp_path / "cell.txt"
    code = f"""
import io, logging, sys
from infercourse.ops.logs import native_logs_to_file
native_logs_to_file({str(log)!r})
cell = io.StringIO(); sys.stderr = cell           # what a Jupyter kernel's stderr is: a Python object
torch_handler = logging.StreamHandler(sys.stderr)  # torch installs one on its logger at import
logging.getLogger("torch").addHandler(torch_handler)
logging.getLogger("torchao.kernel").warning("Failed to load _C_mxfp8.so")
logging.getLogger("torch.utils._pytree").warning("is an Enum subclass")
logging.getLogger("torch.other").warning("torch's own warning stays visible")
open({str(seen)!r}, "w").write(cell.getvalue())   # fd 1 is the log file now
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    out = seen.read_text()
    text = log.read_text()
    assert "Failed to load _C_mxfp8.so" in text and "is an Enum subclass" in text
    assert "Failed to load" not in out and "Enum subclass" not in out
    assert "torch's own warning stays visible" in out
