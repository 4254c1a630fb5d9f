"""Communication: FSDPv2's collective variants, the shared-memory transport of one machine's processes and the
sums through it, replicated gradients' sums, replica agreement, and the switch that turns the CPU-only shortcuts
off."""
