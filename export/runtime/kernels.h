#pragma once
/* The kernel library's interface to Python: the decoder step's session held by the library, its bindings, and the
   decoding loops run there (export/runtime/native.py). native.py declares these to cffi from this very file, so it
   holds plain C declarations only (this file's one preprocessor line is dropped there). Functions that can fail
   return -1 (or a negative count) with the error's message in `error` (error_size bytes). */

/* the ONNX Runtime C API version the library was built for (kernels.py checks it against the running one) */
int nmt_ort_api_version(void);

/* A session of the serialized graph `model` with `threads` intra-op threads and the session config entries
   keys[i] = values[i], made through the ONNX Runtime that registered the library (RegisterCustomOps). */
int nmt_runner_create(const void* model, size_t model_size, int threads, int entries, const char* const* keys,
                      const char* const* values, void** runner_out, char* error, size_t error_size);
void nmt_runner_free(void* runner);

/* A binding of the session's inputs and outputs to host memory; the library keeps what each name is bound to. */
int nmt_binding_create(void* runner, void** binding_out, char* error, size_t error_size);
void nmt_binding_free(void* binding);

/* Binds each of `count` buffers of host memory (data[i]: shapes[8 i …] of ndims[i] dimensions, ONNX element type
   types[i]) to the input names[i], or to that output when outputs[i] (written there in place). */
int nmt_bind(void* binding, int count, const char* const* names, const int* types, const int64_t* shapes,
             const int* ndims, void* const* data, const int* outputs, char* error, size_t error_size);

/* One run of the session over the bound memory. */
int nmt_run(void* runner, void* binding, char* error, size_t error_size);

/* The buffers bound with a row per leading index, which a batch's compaction moves (nmt_greedy_run, nmt_beam_steps):
   names[i] of kind kinds[i]: 0 a row per row; 1 a self-attention cache (rows, heads, slots, dim); 2 cache_origin
   (rows, slots); 3 a row per source (a source's cross K/V and last slot, which its rows share). */
typedef struct {
  int count;
  const char* const* names;
  const int* kinds;
} nmt_row_names;

/* Greedy search of a batch's rows (nmt_greedy_run): each row's source moves with it. */
typedef struct {
  int64_t rows;          /* in: the rows at the start; out: the live rows left (0: all finished), in the first places */
  int64_t* tokens;       /* the step's bound input, written by its search head */
  int64_t* positions;    /* the step's bound input */
  const float* scores;   /* the step's bound output: each row's best token's score */
  const uint8_t* eos;    /* the step's bound outputs (its stopping rule): the row's best token is eos, */
  const uint8_t* at_budget; /* the row has taken its last step */
  int64_t* source;       /* (rows,) each row's source */
  const uint8_t* hole;   /* (rows,) empty places, or NULL: they never advance, finish or are written */
  int64_t until_a_row_ends; /* 1: the run ends after the first step in which a row finishes, and no row moves */
  int64_t max_steps;     /* the cache's room, or fewer */
  double stop_at;        /* CLOCK_MONOTONIC seconds after which the run ends after its current step (0: none) */
  nmt_row_names row_names;
  int64_t sources;       /* the columns of out_tokens */
  int64_t step0;         /* the step the run starts at (`end` counts from it) */
  int64_t* out_tokens;   /* (max_steps, sources) each step's token, at its source's column */
  float* out_scores;     /* the same for scores, or NULL */
  int64_t* end;          /* (sources,) the step at which each source finished */
  uint8_t* by_eos;       /* (sources,) whether it finished on eos */
  /* the server's continuous bursts (keep_rows 1, until_a_row_ends 0): finished rows stay in place, neither
     advancing nor written, and no row moves; the run also ends after a step once newcomers can join (below) */
  int64_t keep_rows;
  const volatile int32_t* waiting; /* requests waiting to join, set by another thread (NULL: none) */
  int64_t free_rows;     /* rows newcomers may take besides the ones that finish in the run */
  int64_t gather;        /* newcomers join in groups of this many rows; a batch of fewer than half as many live rows
                            takes any at once */
  int64_t gather_steps;  /* or once this many steps have run while some wait and a row is free */
  volatile int64_t* progress; /* (1,) the steps run, stored after each step in which a row finishes, then */
  int32_t hand_back_fd;  /* a byte written to this file descriptor (-1: none), for the thread that hands results back */
} nmt_greedy_run_args;

/* Greedy search of a batch's rows from their current step, each row fed its own best token, with no Python between
   steps: the one greedy loop, for offline runs and the server's bursts alike. Each step the session runs (its search
   head writes each row's best token into `tokens` and its score into `scores`, its stopping rule `eos` and `at_budget`),
   every live row advances and its token (and score) is written at its source's column of out_tokens; a row with eos or
   at_budget set finishes (by_eos[its source] = eos), end[its source] = step0 + that step, and from then on neither
   advances nor is written (a hole is finished from the start). The run ends when every row has finished, after
   max_steps, or after a step once CLOCK_MONOTONIC has reached stop_at (when above 0); with
   until_a_row_ends, also after the first step in which a row finishes. Without it, once the finished rows are a
   quarter of the rows they leave (the last live rows move into their places in every buffer of row_names, and in
   `source`, and those names are bound again with the fewer rows); so do any finished rows at the last
   step, whatever ended the run. With keep_rows no row leaves or moves; the run also ends after a step once *waiting
   is above 0 and a row is free (free_rows and those finished): when gather of them wait and are free, once
   gather_steps have run, or at once when fewer than gather / 2 rows are live (the engine's own admission rule,
   export/runtime/engine.py); and after each step in which a row finishes, *progress is set to the steps run and a
   byte is written to hand_back_fd, so that another thread can hand those rows' results back while the run goes on
   (their columns are no longer written). Returns the steps run, or -1 with the error's message (a step that fails
   after others returns those before it, and the next call meets the error; a compaction that fails is -1 at once). */
int64_t nmt_greedy_run(void* runner, void* binding, nmt_greedy_run_args* run, char* error, size_t error_size);

/* Offline beam search of a batch (nmt_beam_steps): searches of one beam size k, whose rows lie one after another, k
   each (a group); arrays "by search" are indexed by search, the others by row or group. */
typedef struct {
  int64_t groups;           /* in: the groups at the start; out: the live groups left (0: all over), first places */
  const int64_t* ids;       /* (rows, width) the step's bound output: each row's width (2k) best candidates */
  const float* scores;      /* (rows, width) their log-probs, best first */
  int64_t width;
  int64_t* tokens;          /* the step's bound inputs */
  int64_t* positions;
  int32_t* origin;          /* (rows, capacity) the state's cache origins */
  int64_t capacity;
  double* beam;             /* (rows,) each row's cumulative log-prob; moves with the rows */
  int64_t* search_of;       /* (groups,) each group's search; moves with the rows */
  int64_t* ordinary;        /* (searches,) the ordinary steps each search may take; -1: it is over */
  int64_t searches;
  int64_t k;
  int64_t eos;
  int64_t max_steps;        /* the cache's room */
  nmt_row_names row_names;
  int64_t* out_parents;     /* (max_steps, searches, k) by search: its ordinary steps' parents (local) */
  int64_t* out_tokens;      /* (max_steps, searches, k) and tokens */
  int64_t* advanced;        /* (searches,) how many ordinary steps each took */
  int64_t* cand_rows;       /* (searches, width) by search: the best extensions of a step `rules` takes: rows (local) */
  int64_t* cand_ids;        /* (searches, width) their tokens */
  double* cand_scores;      /* (searches, width) their cumulative log-probs */
  int64_t* chosen_parents;  /* (searches, k) where `rules` writes each row's parent (local) */
  int64_t* chosen_tokens;   /* (searches, k) and token */
  int (*rules)(int64_t search, int64_t group);  /* takes a search's step that is not ordinary (the search in group
                                                  `group` of the batch now); nonzero: an error, the run ends */
  void* ranker;             /* the ranker graph's runner (export/build/ranker.py): beam search's one ranking */
} nmt_beam_run_args;

/* Offline beam search's steps. The search's rules are nmtserve/search.py's BeamSearch alone: the library takes the
   ordinary steps, where a search's k best extensions simply continue (BeamSearch.ordinary), and calls `rules` back for
   every other. Each step: the session runs, every row's position advances, and the ranker runs once over every group
   (each search's width best of its k × width extensions, as every other loop ranks them, and whether an eos is among
   its k best). On an ordinary step (the ranker says no eos among the k best, an ordinary step left) each row continues its parent with its token (the
   search's next place in out_parents and out_tokens; advanced[search] counts them) and its beam score. On any other,
   its best extensions go into cand_rows, cand_ids and cand_scores, and rules(search, group) writes each row's parent and token
   into chosen_parents and chosen_tokens, its scores into the group's `beam` and ordinary[search] anew. Each row's
   origin row is then copied from its parent's. A search that is over decodes on, each row fed its own best token,
   until the groups over are a quarter of the groups: then they leave the batch (as nmt_greedy_run's rows; `beam` and
   search_of move with them), and so do any over at the last step. Ends when every search is over or after max_steps.
   Returns the steps run, or -1 with the error's message. */
int64_t nmt_beam_steps(void* runner, void* binding, nmt_beam_run_args* run, char* error, size_t error_size);
