"""Run with the installed site directory on PYTHONPATH: prints where strata came from."""
import strata

print(strata.__file__, strata.format_bytes(1536))
