"""argparse types shared by the effmem command and the benchmarks (bench/common.py)."""
import argparse


def int_at_least(minimum: int):
    """argparse type of a whole number >= minimum (steps, sizes: 1; warm-up steps: 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number {'> 0' if minimum == 1 else f'>= {minimum}'}, "
                                             f"got {value}")
        return value
    return parse


positive_int = int_at_least(1)
