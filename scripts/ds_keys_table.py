"""Prints the table of every DeepSpeed config key (offloadpp/integrations/deepspeed/keys.py) as
the Markdown docs/deepspeed.md carries; tests/test_ds_keys.py checks the two agree.

    .venv/bin/python scripts/ds_keys_table.py
"""

from __future__ import annotations

from offloadpp.integrations.deepspeed.keys import KEYS, REFUSED


def main() -> None:
    print("| key | offloadpp | why, or what to use instead |")
    print("| --- | --- | --- |")
    for key, e in KEYS.items():
        status = e.status
        if e.status == REFUSED and e.allowed is not None:
            status += " unless " + " or ".join(
                "null" if a is None else repr(a).lower().replace("'", '"') for a in e.allowed
            )
        print(f"| `{key}` | {status} | {e.note} |")


if __name__ == "__main__":
    main()
