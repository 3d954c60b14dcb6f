"""Examples shipped with surge (package data: their YAML files travel with the wheel)."""
