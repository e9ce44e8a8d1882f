"""``python -m asynckv.integrations.sglang <sglang.launch_server arguments>``: SGLang's server with
``--disaggregation-transfer-backend asynckv`` available, in this process and in every process it
spawns (SGLang starts its schedulers with ``spawn``; each spawned child imports this module again,
as ``__mp_main__``, and so installs the backend before it unpickles its work)."""

from __future__ import annotations

import runpy

from . import install

install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
