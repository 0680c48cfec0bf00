// Evaluates a token sequence with llama.cpp (through its public C API) and prints, for every
// position, the log-sum-exp of the whole logit row and the `top_k` largest logits with their
// token ids, as one JSON object on stdout.
//
// The whole sequence is one batch of one sequence (positions 0..n-1, every position asks for its
// logits), as a prompt is evaluated; the reference-logit test runs ember the same way.
//
// Usage: dump_logits MODEL.gguf THREADS TOP_K ID,ID,...
//
// Built by build_llama.sh against the llama.cpp it builds; not part of ember.

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet_log(enum ggml_log_level level, const char *text, void *user_data) {
    (void) user_data;
    // Keep stderr for warnings and errors so a failing load says why.
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int parse_ids(const char *text, llama_token **out) {
    int capacity = 16, n = 0;
    llama_token *ids = malloc(sizeof(llama_token) * capacity);
    const char *p = text;
    while (*p) {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0) {
            fprintf(stderr, "dump_logits: bad token id list at \"%s\"\n", p);
            free(ids);
            return -1;
        }
        if (n == capacity) {
            capacity *= 2;
            ids = realloc(ids, sizeof(llama_token) * capacity);
        }
        ids[n++] = (llama_token) v;
        p = end;
        if (*p == ',') {
            p++;
        }
    }
    *out = ids;
    return n;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS TOP_K ID,ID,...\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[1];
    const int n_threads = atoi(argv[2]);
    const int top_k = atoi(argv[3]);
    llama_token *tokens = NULL;
    const int n_tokens = parse_ids(argv[4], &tokens);
    if (n_threads <= 0 || top_k <= 0 || n_tokens <= 0) {
        fprintf(stderr, "dump_logits: expected positive THREADS, TOP_K and at least one id\n");
        return 2;
    }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();

    struct llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(model_path, mparams);
    if (!model) {
        fprintf(stderr, "dump_logits: cannot load %s\n", model_path);
        return 1;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    if (top_k > n_vocab) {
        fprintf(stderr, "dump_logits: TOP_K %d exceeds the vocabulary of %d\n", top_k, n_vocab);
        return 2;
    }

    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) (n_tokens < 256 ? 256 : n_tokens);
    cparams.n_batch = (uint32_t) n_tokens;
    cparams.n_ubatch = (uint32_t) n_tokens;
    cparams.n_seq_max = 1;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "dump_logits: cannot create a context\n");
        return 1;
    }

    struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    for (int i = 0; i < n_tokens; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "dump_logits: llama_decode failed\n");
        return 1;
    }

    int *order = malloc(sizeof(int) * top_k);
    printf("{\"n_vocab\": %d, \"system_info\": \"%s\", \"positions\": [\n", n_vocab,
           llama_print_system_info());
    for (int i = 0; i < n_tokens; i++) {
        const float *logits = llama_get_logits_ith(ctx, i);
        // Log-sum-exp in double around the maximum, so the reference's log-probabilities are
        // exact to float precision however peaked the row is.
        float max = -INFINITY;
        for (int v = 0; v < n_vocab; v++) {
            if (logits[v] > max) {
                max = logits[v];
            }
        }
        double sum = 0.0;
        for (int v = 0; v < n_vocab; v++) {
            sum += exp((double) logits[v] - (double) max);
        }
        const double lse = (double) max + log(sum);
        // Selection of the top_k by insertion: ties keep the lower id first.
        int n_kept = 0;
        for (int v = 0; v < n_vocab; v++) {
            int at = n_kept;
            while (at > 0 && logits[order[at - 1]] < logits[v]) {
                at--;
            }
            if (at >= top_k) {
                continue;
            }
            int last = n_kept < top_k ? n_kept : top_k - 1;
            memmove(&order[at + 1], &order[at], sizeof(int) * (size_t) (last - at));
            order[at] = v;
            if (n_kept < top_k) {
                n_kept++;
            }
        }
        printf("  {\"logsumexp\": %.17g, \"top\": [", lse);
        for (int j = 0; j < n_kept; j++) {
            printf("%s[%d, %.9g]", j ? ", " : "", order[j], (double) logits[order[j]]);
        }
        printf("]}%s\n", i + 1 < n_tokens ? "," : "");
    }
    printf("]}\n");

    free(order);
    free(tokens);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
