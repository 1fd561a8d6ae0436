"""The userbuffers config model: TE's ``ub_cfgs`` as typed data and YAML (``config``), TE's rules
(``rules``), the hand-written presets (``presets``) and NeMo/Bridge's dataclasses (``layer_cfg``)."""
