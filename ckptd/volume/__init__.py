"""The volume as the kernel shows it: the mount table, and opening a file on it to read."""
