"""What the crash harness and the power-cut simulation check of the backing directory's space."""
import os
import stat


def blocks_past_ends(backing):
    """Backing files that hold more than one block past the end of their last block (an extent
    index block is one): (path, size, allocated bytes). After a recovery, files the daemon made
    ahead and named before it died have been given back what they held there."""
    found = []
    for root, _dirs, files in os.walk(backing):
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                whole_blocks = -(-st.st_size // st.st_blksize) * st.st_blksize
                if st.st_blocks * 512 > whole_blocks + st.st_blksize:
                    found.append((os.path.relpath(path, backing), st.st_size, st.st_blocks * 512))
    return found
