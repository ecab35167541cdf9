"""The local Hub server is a tool (`python -m hf_dp_repr.hub.local_server --port N`): it starts from the command
line, says where it listens, and answers the Hub's API there until stopped."""

import json
import subprocess
import sys
import urllib.request


def test_the_local_hub_starts_from_the_command_line_and_serves_the_api():
    server = subprocess.Popen([sys.executable, "-m", "hf_dp_repr.hub.local_server", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("local Hub at http://127.0.0.1:"), line
        url = line.split()[3].rstrip(":")
        request = urllib.request.Request(f"{url}/api/whoami-v2", headers={"Authorization": "Bearer hf_write_someone"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read())["name"] == "someone"
    finally:
        server.terminate()
        server.wait(timeout=30)
