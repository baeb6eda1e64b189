"""The launch gate (docs/runbook.md): environment guard, config preflight, GO/NO-GO records, and the launcher
that starts the trainer with torchrun only when a fresh GO record exists for this code and this config.

Modules: policy (every threshold), env (`python -m sentinels env`), preflight (config rules), code (which code is
this: commit + source digest), gonogo (records and the check the launcher and the trainer share), gates (the
preflight pipeline), launch (the torchrun launcher), cli (`python -m sentinels.launch env|preflight|launch`).
"""
