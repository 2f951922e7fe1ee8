"""Drafter networks that run beside a target: MTP modules, EAGLE-3 heads, DFlash and DSpark blocks."""
