import subprocess
import sys


def test_import_service_never_imports_torch() -> None:
    code = (
        "import sys, service, service.server, service.client, service.batching, service.scheduler, service.cli,"
        " service.bench;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
