/* crc32c.h - CRC-32C (Castagnoli, polynomial 0x1EDC6F41 reflected): the checksum of the sharded
 * checkpoints' files (shard_ckpt.h) and of TensorBoard's record framing (tfevents.h). */
#ifndef AM_CRC32C_H
#define AM_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* crc32c of len bytes, continuing from crc (0 to start). */
uint32_t am_crc32c(uint32_t crc, const void *buf, size_t len);

#endif
