#!/usr/bin/env python3
"""copse's Python kernel: ipykernel, started by copse_interpreter.py.

The interpreter runs under an account of its own and has its kernels
started as the sandbox's user; this is the program it starts. The kernel's
connection (transport, address, ports, signing key) arrives in the
environment variable ``COPSE_KERNEL_CONNECTION`` as JSON and is handed to
ipykernel as configuration: no connection file is read or written (the
interpreter's files are not this user's to read, and a kernel killed
without warning would leave one behind), and the key never appears on a
command line, which every process can read. The variable is removed before
any cell runs.
"""

import json
import os
import sys

from ipykernel.kernelapp import IPKernelApp


class Kernel(IPKernelApp):
    """IPKernelApp minus its connection file."""

    def init_connection_file(self):
        pass

    def write_connection_file(self):
        pass


def arguments(connection):
    key = connection["key"]
    if not key.isalnum():
        raise SystemExit("the kernel's key must be hex digits")
    return [
        f"--transport={connection['transport']}",
        f"--ip={connection['ip']}",
        f"--shell={int(connection['shell_port'])}",
        f"--iopub={int(connection['iopub_port'])}",
        f"--stdin={int(connection['stdin_port'])}",
        f"--control={int(connection['control_port'])}",
        f"--hb={int(connection['hb_port'])}",
        f"--Session.key={key}",
        f"--Session.signature_scheme={connection.get('signature_scheme', 'hmac-sha256')}",
    ]


def main():
    connection = json.loads(os.environ.pop("COPSE_KERNEL_CONNECTION"))
    Kernel.launch_instance(arguments(connection) + sys.argv[1:])


if __name__ == "__main__":
    main()
