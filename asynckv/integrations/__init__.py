"""Adapters that put asynckv under serving engines whose schedulers are synchronous threads.

``loop_thread`` runs asynckv's event loop on a background thread of such a process;
``sglang`` implements SGLang's transfer-backend interface on it
(``--disaggregation-transfer-backend asynckv``, see docs/integration.md).
"""
