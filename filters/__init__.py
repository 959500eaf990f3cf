"""mmguard's filters, one module each. Each exposes a factory registered under the
``mmguard.filters`` entry-point group in pyproject.toml; ``proxy`` finds them there."""
