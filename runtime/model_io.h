/* model_io.h - a model's parameters to and from a Hugging Face model directory.
 *
 * Loading reads only this rank's slice of each tensor (rows or columns of the full
 * matrix, as the tensor-parallel split says), so no rank ever holds the whole model.
 * Saving writes the model in Hugging Face's layout (config.json + safetensors) atomically;
 * it needs every parameter whole on the saving rank (tp = 1 and one pipeline stage).
 */
#ifndef AM_MODEL_IO_H
#define AM_MODEL_IO_H

#include "errors.h"
#include "model.h"

/* Copies every parameter of m from the directory (model.safetensors or the sharded set).
 * Returns 0, or -1 with messages naming the tensor (missing, or of another shape). */
int am_model_load_hf(struct am_model *m, const char *dir, struct am_errors *err);

/* True when dir holds weights (model.safetensors or model.safetensors.index.json). */
int am_model_dir_has_weights(const char *dir);

/* Writes m to dir (replacing what is there only once the new checkpoint is complete).
 * base_config, when not NULL, is the config.json the model came from: its other keys
 * (token ids, ...) are kept. */
int am_model_save_hf(const struct am_model *m, const char *dir, const char *base_config, struct am_errors *err);

#endif
