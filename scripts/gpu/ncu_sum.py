"""Sum an ncu --csv gpu__time_duration listing by kernel (name cut before its template
arguments), largest first. Usage: python3 scripts/gpu/ncu_sum.py FILE.csv [forwards]; prints
milliseconds per forward."""
import csv
import sys
from collections import Counter


def main(path, forwards=1):
    rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    head, rows = rows[0], rows[1:]
    name, value = head.index("Kernel Name"), head.index("Metric Value")
    total, count = Counter(), Counter()
    for r in rows:
        k = r[name].split("(")[0].split("<")[0].replace("void ", "")[:70]
        total[k] += float(r[value].replace(",", "")) / 1e6 / forwards
        count[k] += 1
    print(f"{sum(total.values()):.3f} ms of kernels per forward, {len(rows) // forwards} launches")
    for k, ms in total.most_common():
        print(f"{ms:8.3f} ms {count[k] // forwards:4d}x  {k}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
