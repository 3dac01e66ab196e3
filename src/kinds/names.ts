// The built-in kinds' names alone, importing nothing: what migrate creates queues for and metrics label,
// without loading the kinds themselves. src/kinds/index.ts registers the same kinds (test/unit/layout.test.ts checks).
export const BUILT_IN_KINDS: readonly string[] = ['charge', 'refund', 'capture', 'cancel'];
