"""``python -m fmkv`` (or ``fmkv-py``): print the version, format version and backends."""
import sys


def main(argv=None) -> int:
    import fmkv

    print(f"fmkv {fmkv.__version__} (format v{fmkv.format_version()})")
    for name, info in fmkv.backends().items():
        state = "available" if info["available"] else "not available"
        dev = f" - {info['device']}" if info["device"] else ""
        print(f"  {name:6s} {state}{dev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
