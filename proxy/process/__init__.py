"""The process: ``server`` (listeners, reload, drain), ``listeners`` (connection and body caps),
``admin`` (the admin listener), ``supervisor`` (``--workers N``), ``watch`` (the config file
watch)."""
