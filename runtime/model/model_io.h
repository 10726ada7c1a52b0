/* model_io.h - a model's parameters to and from a Hugging Face model directory.
 *
 * Loading reads only this rank's slice of each tensor (rows or columns of the full
 * matrix, as the tensor-parallel split says), so no rank ever holds the whole model.
 * Saving writes the model in Hugging Face's layout (config.json + safetensors) atomically,
 * from one rank holding it whole (am_model_save_hf) or from any tp x pp layout
 * (am_model_save_hf_dist): the same files either way.
 */
#ifndef AM_MODEL_IO_H
#define AM_MODEL_IO_H

#include <stdbool.h>

#include "errors.h"
#include "model.h"

/* Copies every parameter of m from the directory (model.safetensors or the sharded set).
 * Returns 0, or -1 with messages naming the tensor (missing, or of another shape). */
int am_model_load_hf(struct am_model *m, const char *dir, struct am_errors *err);
/* (LoRA's adapters, am_model_is_lora, are neither loaded nor saved by the am_model_*_hf functions.) */

/* Copies every LoRA adapter of m from dir/adapter_model.safetensors, as the peft library saves
 * them ("base_model.model." + the parameter's name; gpt_oss's experts' in peft's ParamWrapper
 * tensors, am_model_peft_place), each rank its tp slice. Returns 0, or -1
 * with messages naming the tensor (missing, or of another shape). */
int am_model_load_peft(struct am_model *m, const char *dir, struct am_errors *err);

/* Where LoRA's adapter p lies in peft's adapter_model.safetensors (am_model_save_peft_dist):
 * the tensor's name and shape, and (at not NULL) the flat index in it of each element (row y,
 * column c) of p's full matrix, at[y * full_cols + c]. gpt_oss's experts' adapters lie in the
 * four ParamWrapper tensors of their layer's fused experts (returns 1); every other adapter is its
 * own tensor, "base_model.model." + its name, in order (returns 0). */
int am_model_peft_place(const struct am_model *m, const struct am_param *p, char *name, size_t len, int64_t shape[2],
                        int64_t *at);

/* True when dir holds weights (model.safetensors or model.safetensors.index.json). */
int am_model_dir_has_weights(const char *dir);

/* Writes m to dir (replacing what is there only once the new checkpoint is complete).
 * base_config, when not NULL, is the config.json the model came from: its other keys
 * (token ids, ...) are kept. */
int am_model_save_hf(const struct am_model *m, const char *dir, const char *base_config, struct am_errors *err);

/* Saves the model held by one replica's ranks (every tp and pp rank of data-parallel rank 0;
 * collective over them: call it on each) to dir, as am_model_save_hf does from one rank: the
 * same tensors, in model order, the same bytes. pp rank 0 / tp rank 0 writes (one call of
 * am_ckpt_save); each pp rank's tp rank 0 first sends it the names and full shapes of its
 * tensors over pp, then, as the writer asks for each tensor, the tp ranks of its holder gather
 * it (all-gather of the slices, re-assembled by rows or columns; a kv head shared by several
 * tp ranks is written once) and tp rank 0 sends it whole to the writer over pp: one tensor at
 * a time, so no rank holds more than about two tensors beyond its shard. A tied embedding's
 * copy on the last stage is not written twice. tp or pp may be NULL (size 1); with both NULL
 * this is am_model_save_hf. The communicators carry host memory (UCX, as the trainer's).
 *
 * Returns: on the writer, am_ckpt_save's result (-1 also when another rank could not take
 * part, which its own errors explain, or could not be told that the save is over); elsewhere 0 once the writer has finished (whether or
 * not it succeeded: only the writer knows), -1 on a local or communication error. Wrong
 * arguments (tp not the model's tp group, pp rank 0 without the first stage) fail at once
 * where they are wrong. A rank that cannot allocate its one-tensor buffers says so to the
 * others, and the save fails everywhere without blocking; the writer always tells the others
 * when it is done, failure included. But a rank that returns early (wrong arguments, no
 * memory for its tensor list), fails in communication or dies, or a writer failing part-way
 * in a communication, leaves the others blocked in a send or receive until the
 * communicators' timeout. Every wait of a serving rank lasts as long as the writer takes
 * between two of its tensors (writing the other ranks' tensors meanwhile), which the timeout
 * must allow. */
int am_model_save_hf_dist(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, const char *dir,
                          const char *base_config, struct am_errors *err);
/* The same with expert parallelism: collective over ep first (every rank of each ep group,
 * saves or not), which gathers every expert of the MoE layers into the host of each of them;
 * then the ranks with saves (one replica: its tp and pp ranks) save as am_model_save_hf_dist,
 * the gathered experts written in place of their own. ep NULL or of one rank: am_model_save_hf_dist.
 * A rank without saves returns 0 after the gather (-1 if it failed). */
int am_model_save_hf_ep(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, struct am_comm *ep,
                        bool saves, const char *dir, const char *base_config, struct am_errors *err);

/* LoRA: the model's adapters alone, as the peft library saves them (ckpt/peft.h:
 * adapter_config.json with r, alpha and the targeted modules, and adapter_model.safetensors,
 * "base_model.model." + each adapter's name), gathered over tp and pp as
 * am_model_save_hf_dist gathers the base (collective over the ranks with saves: one replica's
 * tp and pp ranks; a rank without saves returns 0 at once). base_model: the adapter config's
 * base_model_name_or_path, or NULL. With adapters on the experts (moe.h) they are gathered over
 * ep first, as am_model_save_hf_ep gathers the experts (collective over ep: every rank of it,
 * with saves or not), each expert's adapters under peft's per-expert names (the shared A of
 * gate and up as both gate's and up's lora_A), and target_modules lists each expert's gate, up
 * and down by path, as AutoModel's adapter_config.json does. */
int am_model_save_peft_dist(const struct am_model *m, struct am_comm *tp, struct am_comm *pp, struct am_comm *ep,
                            bool saves, const char *dir, const char *base_model, struct am_errors *err);

/* The experts' selection biases (moe.h) in a sharded checkpoint, when training updates them
 * (gate_bias_update_factor > 0): save writes the biases of m's MoE layers, whole, by their
 * Hugging Face names, to one safetensors file at path (nothing without MoE layers); load reads
 * each of m's from whichever of the *.safetensors files in dir holds it (the files of every
 * rank that wrote: at any layout), 0 when dir does not exist (a checkpoint of a run without
 * the update: the model directory's biases stay), or -1 with a message naming the missing
 * tensor. */
#define AM_MODEL_BIAS_FILES 4096
int am_model_save_biases(const struct am_model *m, const char *path, struct am_errors *err);
int am_model_load_biases(struct am_model *m, const char *dir, struct am_errors *err);

#endif
