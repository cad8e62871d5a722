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
