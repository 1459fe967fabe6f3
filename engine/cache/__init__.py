"""The prefix cache: RAM tier, SSD tier (through ``storage``), write-behind durability,
the mapping of mlx-lm prompt caches onto blocks, and restore buffers."""
