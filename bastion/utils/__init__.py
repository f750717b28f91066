"""Utilities shared by every room: files and folders, the one dtype parser, argument checks, logs, counted host syncs, text and chat rendering, robust running levels."""
