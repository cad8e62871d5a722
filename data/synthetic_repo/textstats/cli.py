"""Command line: python -m textstats.cli FILE [--top N]."""
import argparse

from .report import report


def main(argv=None):
    parser = argparse.ArgumentParser(description="word statistics for a text file")
    parser.add_argument("path")
    args = parser.parse_args(argv)
    with open(args.path, encoding="utf-8") as f:
        print(report(f.read()))


if __name__ == "__main__":
    main()
