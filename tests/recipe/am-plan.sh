#!/bin/bash
# am-plan from the command line: exit status, the table, the JSON object, and messages.
set -u
src=${AM_SRCDIR:-.}
bin=${AM_BUILDDIR:-.}/am-plan
recipes=$src/sbatch-templates/recipes
fails=0 passes=0

check() { # NAME EXPECTED_RC EXPECTED_TEXT(fixed string, in stdout+stderr) -- COMMAND...
    local name=$1 want_rc=$2 want=$3
    shift 4
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" != "$want_rc" ] || ! grep -qF -- "$want" <<<"$out"; then
        echo "FAIL: $name (exit $rc, want $want_rc; want text: $want)"
        echo "$out" | sed 's/^/    /'
        fails=$((fails + 1))
    else
        echo "ok: $name"
        passes=$((passes + 1))
    fi
}

check_lacks() { # NAME UNWANTED_TEXT -- COMMAND... (exits 0, prints no UNWANTED_TEXT)
    local name=$1 unwanted=$2
    shift 3
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" != 0 ] || grep -qF -- "$unwanted" <<<"$out"; then
        echo "FAIL: $name (exit $rc, want 0; unwanted text: $unwanted)"
        echo "$out" | sed 's/^/    /'
        fails=$((fails + 1))
    else
        echo "ok: $name"
        passes=$((passes + 1))
    fi
}

check "llama70b on 8 nodes x 8 fits 80G" 0 \
    "layout       tp 8 x pp 4 x cp 1 x dp 2 (replicate 1 x shard 2); ep 1 (ep_shard 2); fsdp2, sequence parallel" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --gpu-mem 80G
check "llama70b pipeline line" 0 "pipeline     1f1b: 4 stages of 20 layers (1 per rank), 8 micro-batches of 1" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --gpu-mem 80G
check "llama70b batch line" 0 "batch        global 256 = local 8 x dp 2 x 16 accumulation steps; sequence 8192" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --gpu-mem 80G
check "json object" 0 '"world_size":64,"strategy":"fsdp2","tp_size":8,"pp_size":4,"cp_size":1,"ep_size":1,"dp_size":2,"dp_replicate_size":1,"dp_shard_size":2' \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
check "json has the step figures" 0 '"grad_accum_steps":16' \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
check "json lists ignored keys" 0 '"errors":[],"ignored_keys":["recipe","loss_fn","model._target_"' \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
check "json memory" 0 '"memory_per_gpu_bytes":' -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
# every pipeline rank's memory (memory_breakdown is the most loaded one's): pp 2 of tiny, the
# first stage's 1F1B keeps two micro-batches' activations, the last one; the CUDA kernels' scratch:
# the first stage's attention row sums (4 x 64 tokens x 4 heads), the last's cross-entropy tile
# (64 rows x 256 ids x 4)
check "json has every pp rank's memory" 0 \
    '"activations":1005568.0,"scratch":254720.0,"kernel_scratch":1024.0,"pipeline_buffers":81920.0,"alltoall_buffers":0.0,"pp_rank":0,"total":3084032.0,"expert_rows":0.0,"expert_rows_worst":0.0},{"weights":435456.0,"grads":435456.0,"optimizer":870912.0,"gathered_params":0.0,"grad_buffers":0.0,"activations":502784.0,"scratch":288000.0,"kernel_scratch":65536.0,"pipeline_buffers":49152.0,"alltoall_buffers":0.0,"pp_rank":1,"total":2647296.0,"expert_rows":0.0,"expert_rows_worst":0.0}]' \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set distributed.pp_size=2 --json
check "json flops" 0 '"flops_per_step":' -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
check "override makes it invalid" 1 \
    "error: --set distributed.tp_size=3: distributed.tp_size: 3 does not divide num_attention_heads = 64 (use 1, 2, 4, 8, 16, 32 or 64)" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --set distributed.tp_size=3
check "json carries errors" 1 \
    '{"assumed":{},"errors":["--set distributed.ep_size=2: distributed.ep_size: 2 needs a mixture-of-experts model; llama has no experts (use ep_size: 1)"]' \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --set distributed.ep_size=2 --json
check "too little GPU memory names the fix" 1 \
    "error: $recipes/llama70b.yaml: estimated memory per GPU 126.1 GiB exceeds the GPU's 80.0 GiB by 46.1 GiB; it fits with distributed.activation_checkpointing=true (35.3 GiB), distributed.sequence_parallel=true (54.0 GiB)" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --gpu-mem 80G \
    --set distributed.activation_checkpointing=false --set distributed.sequence_parallel=false \
    --set step_scheduler.local_batch_size=16 --set distributed.pipeline.pp_microbatch_size=2
check "world not divisible" 1 \
    "distributed.dp_size: none is inferred as world size / (tp_size*pp_size*cp_size) = 24 / 32, not a whole number" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 3 --gpus-per-node 8
check "missing recipe" 1 "error: /nonexistent.yaml: cannot open: No such file or directory" \
    -- "$bin" /nonexistent.yaml
check "tiny on 2 ranks" 0 "layout       tp 1 x pp 1 x cp 1 x dp 2 (replicate 1 x shard 2); ep 1 (ep_shard 2); fsdp2" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2
check "tiny_moe with experts" 0 "ep 2 (ep_shard 2)" -- "$bin" "$recipes/tiny_moe.yaml" --gpus-per-node 4
# fsdp2 shards over the 8 data-parallel ranks (ZeRO-3, train/fsdp.h): per 8.03B parameters a
# 1/8 shard of fp32 masters + their bf16 copy (6 B), of Adam's moments (8 B) and of the reduced
# gradients (4 B), two gathered groups in bf16 (the embedding, the largest), two fp32 gradient
# buffers of the embedding's size with their receive shards (4.4 GiB), 6.0 GiB of activations
# 2.4 GiB of the model's scratch buffers and 450 MiB of the CUDA kernels' (cuDNN's attention
# backward: 16384 tokens x 32 heads x 128 x (4 + 2) B, the row sums and bf16 dk, dv): 32.0 GiB
check "llama3_8b on 8 GPUs fits 80G with fsdp2" 0 "memory/GPU   32.0 GiB on pp rank 0 of 80.0 GiB" \
    -- "$bin" "$recipes/llama3_8b.yaml" --gpu-mem 80G
check "llama3_8b's breakdown" 0 \
    "             weights 5.6 GiB, gradients 3.7 GiB, optimizer 7.5 GiB, gathered 2.0 GiB, gradient buffers 4.4 GiB, activations 6.0 GiB, scratch 2.4 GiB, kernels' scratch 450.0 MiB" \
    -- "$bin" "$recipes/llama3_8b.yaml" --gpu-mem 80G
# ddp keeps full replicas: 18 B x 8.03B = 134.6 GiB + activations; the advice is to shard
check "llama3_8b with ddp exceeds 80G, fits with fsdp2" 1 \
    "error: $recipes/llama3_8b.yaml: estimated memory per GPU 143.4 GiB exceeds the GPU's 80.0 GiB by 63.4 GiB; it fits with distributed.strategy=fsdp2 (32.0 GiB)" \
    -- "$bin" "$recipes/llama3_8b.yaml" --gpu-mem 80G --set distributed.strategy=ddp
# HSDP (2 replicas of 4 shards): each rank keeps a quarter: 49.3 GiB
check "llama3_8b with HSDP shards over dp_shard 4" 0 "memory/GPU   49.3 GiB on pp rank 0 of 80.0 GiB" \
    -- "$bin" "$recipes/llama3_8b.yaml" --gpu-mem 80G --set distributed.dp_replicate_size=2
check_lacks "fsdp2 has no sharding note" "does not shard yet" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2
check_lacks "HSDP has no sharding note" "does not shard yet" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 4 --set distributed.dp_replicate_size=2
check "megatron_fsdp shards per zero_dp_strategy" 0 '"dp_replicas":"sharded","zero_stage":2,' \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --json --set distributed.strategy=megatron_fsdp \
    --set distributed.zero_dp_strategy=2
check_lacks "megatron_fsdp has no sharding note" "does not shard yet" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set distributed.strategy=megatron_fsdp
check_lacks "ddp has no sharding note" "does not shard yet" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set distributed.strategy=ddp
check "json says fsdp2 shards" 0 '"dp_shard_size":2,"dp_replicas":"sharded","zero_stage":3,' \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --json
check "bad size" 2 "am-plan: --gpu-mem: '80X' is not a size (use e.g. 80G or 141GiB)" \
    -- "$bin" "$recipes/tiny.yaml" --gpu-mem 80X
check "size that is not a number" 2 "am-plan: --gpu-mem: 'nan' is not a size (use e.g. 80G or 141GiB)" \
    -- "$bin" "$recipes/tiny.yaml" --gpu-mem nan
check "bad count" 2 "am-plan: --nodes: 'zero' is not a whole number from 1 to 1048576" \
    -- "$bin" "$recipes/tiny.yaml" --nodes zero
check "bad --set" 2 "am-plan: --set: expected KEY=VALUE" -- "$bin" "$recipes/tiny.yaml" --set tp_size
check "no recipe" 2 "usage: am-plan RECIPE" -- "$bin"

# ---- the lead of Slurm's warning (docs/checkpoints.md) ------------------------------------------------
# llama70b on 8 x 8 (fsdp2, dp_shard 2): all 64 ranks write their shard; the Hugging Face export
# (save_consolidated, true by default) 4 bytes a parameter; at 1 GiB/s per node by default
check "llama70b's checkpoint" 0 \
    "checkpoint   1051.4 GiB a save: 64 shards, the largest 12.7 GiB, 101.5 GiB from one node at most; Hugging Face export 262.8 GiB from one rank" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8
# (101.5 GiB of shards + 262.8 GiB of export) / 1 GiB/s = 364.3 s; x 1.5 = 546.5
check "llama70b's save estimate" 0 "save         364.3 s estimated at 1.0 GiB/s per node (--ckpt-bw)" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8
check "llama70b's step is not known" 0 \
    "step         not known: give a run's log directory with --logs DIR (its steps' step_s)" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8
check "llama70b's lead" 0 \
    "lead         #SBATCH --signal=B:USR1@547   (1.5 x save, rounded up, at least 60 s; one step not counted: add the same for it)" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8
# the largest shard: the last stage's tp slice of 20 layers and the head, halved over dp_shard:
# 1135382528 elements x 12 B; a node holds one (pp, dp_shard) slice's 8 tp ranks
check "json: llama70b's checkpoint" 0 \
    '"checkpoint":{"enabled":true,"bytes":1128970092544.0,"shards":64,"shard_bytes_max":13624590336.0,"node_bytes_max":108996722688.0,"hf_bytes":282214825984.0,"write_bw":1073741824.0,"save_estimate_s":364.34414672851562,"save_s":364.34414672851562,"save_from":"estimate","step_s":null,"step_from":null,"lead_s":547,"signal":"B:USR1@547"}' \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --json
# 4 GiB/s per node: 91.1 s, lead ceil(136.6) = 137
check "a faster filesystem" 0 "lead         #SBATCH --signal=B:USR1@137   (1.5 x save" \
    -- "$bin" "$recipes/llama70b.yaml" --nodes 8 --gpus-per-node 8 --ckpt-bw 4GiB/s
check "checkpoints disabled: no lead" 0 \
    "checkpoint   disabled (checkpoint.enabled): nothing is saved when Slurm warns the job; no --signal lead" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2
check "json: checkpoints disabled" 0 '"checkpoint":{"enabled":false}' \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --json
check "bad bandwidth" 2 "am-plan: --ckpt-bw: '1Q/s' is not a bandwidth (use e.g. 2G or 500M/s: bytes per second per node)" \
    -- "$bin" "$recipes/tiny.yaml" --ckpt-bw 1Q/s
check "no such log directory" 2 \
    "am-plan: --logs: /nonexistent-logs: No such file or directory (give the job's log directory: <log dir>/<job id>, holding rank-<R>.jsonl)" \
    -- "$bin" "$recipes/tiny.yaml" --logs /nonexistent-logs

# a run's logs (job 4242, 3 ranks): rank 0 stepped 9.0 s for 70 steps, then 2.0 s for its last 64
# (its recent median 2.0); rank 1 alternated 2.4 and 2.6 s (median 2.5: the slowest rank);
# rank 2 stepped 2.2 s, with a flight record and a cut last line. Saves every 20 steps: rank
# 0's took 95.0 s (step 20: older than its last 4), then 30.0 ... 41.5 s (step 120); rank 1's at
# most 40.0; rank 2's one 12.0. The lead: ceil(1.5 x (2.5 + 41.5)) = 66 s.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
mkdir -p "$logs/4242"
step_rec() { # STEP STEP_S
    printf '{"type":"step","step":%d,"loss":5.25,"lr":0.0001,"grad_norm":1.5,"tokens":1024,"step_s":%s,"time":%d.5,"comm_s":0.25,"max_rss_kib":1000}\n' \
        "$1" "$2" $((1800000000 + $1))
}
save_rec() { # STEP SECONDS
    printf '{"type":"checkpoint_start","step":%d,"time":%d.0}\n' "$1" $((1800000000 + $1))
    printf '{"type":"checkpoint","step":%d,"dir":"/scratch/ckpt/step-%d","seconds":%s,"format":"sharded","writes":true,"time":%d.9}\n' \
        "$1" "$1" "$2" $((1800000000 + $1))
}
{
    printf '{"type":"start","host":"n1","pid":1,"rank":0,"world":3,"job":"4242","time":1800000000.0}\n'
    for i in $(seq 1 134); do
        step_rec "$i" "$([ "$i" -le 70 ] && echo 9.0 || echo 2.0)"
        case $i in 20) save_rec 20 95.0 ;; 40) save_rec 40 30.0 ;; 60) save_rec 60 31.0 ;; 80) save_rec 80 32.0 ;;
        100) save_rec 100 33.0 ;; 120) save_rec 120 41.5 ;; esac
    done
} >"$logs/4242/rank-0.jsonl"
{
    printf '{"type":"start","host":"n1","pid":2,"rank":1,"world":3,"job":"4242","time":1800000000.0}\n'
    for i in $(seq 1 134); do
        step_rec "$i" "$([ $((i % 2)) = 0 ] && echo 2.4 || echo 2.6)"
        [ $((i % 20)) = 0 ] && save_rec "$i" "$([ "$i" = 100 ] && echo 40.0 || echo 20.0)"
    done
} >"$logs/4242/rank-1.jsonl"
{
    printf '{"type":"start","host":"n2","pid":3,"rank":2,"world":3,"job":"4242","time":1800000000.0}\n'
    for i in $(seq 1 12); do step_rec "$i" 2.2; done
    save_rec 10 12.0
    printf '{"type":"flight","group":"dp","gid":1,"op":"allreduce","seq":7,"count":1024,"bytes":4096,"state":"done","enqueued":1800000010.0,"started":1800000010.1,"ended":1800000010.2}\n'
    printf '{"type":"step","step":13,"loss":5.2'
} >"$logs/4242/rank-2.jsonl"
check "save from the logs" 0 \
    "save         41.500 s measured: the longest recent save in $logs (rank 0, step 120); estimated 0.0 s at 1.0 GiB/s per node" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set checkpoint.enabled=true --logs "$logs"
check "step from the logs" 0 \
    "step         2.500 s measured: the median of the slowest rank's recent steps in $logs (rank 1)" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set checkpoint.enabled=true --logs "$logs"
check "lead from the logs" 0 "lead         #SBATCH --signal=B:USR1@66   (1.5 x (step + save), rounded up, at least 60 s)" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set checkpoint.enabled=true --logs "$logs"
check "json: the lead from the logs" 0 \
    '"save_s":41.5,"save_from":"logs","step_s":2.5,"step_from":"logs","lead_s":66,"signal":"B:USR1@66","logs":{"dir":"'"$logs"'","ranks":3,"step_ranks":3,"save_ranks":3,"step_rank":1,"save_rank":0,"save_step":120}}' \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set checkpoint.enabled=true --logs "$logs" --json
# logs without saves: the estimate stays, the step is measured
mkdir -p "$logs/nosave/9"
grep -v checkpoint "$logs/4242/rank-1.jsonl" >"$logs/nosave/9/rank-0.jsonl"
check "logs without saves keep the estimate" 0 \
    "lead         #SBATCH --signal=B:USR1@60   (1.5 x (step + save), rounded up, at least 60 s)" \
    -- "$bin" "$recipes/tiny.yaml" --gpus-per-node 2 --set checkpoint.enabled=true --logs "$logs/nosave/9"

echo "am-plan: $passes passed, $fails failed"
[ "$fails" = 0 ]
