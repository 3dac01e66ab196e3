import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    globalSetup: ['./test/support/globalSetup.ts'],
    include: ['test/**/*.test.ts', 'examples/**/*.test.ts'],
    // Each file has its own database; files run in parallel on the two cores, tests in a file in order.
    fileParallelism: true,
    maxWorkers: 3,
    testTimeout: 60_000,
    hookTimeout: 120_000,
    // expect.poll's own default (1 s) is shorter than one page load of a browser test on a loaded machine:
    // the poll then fails on its callback's time, not on what it saw. A bound, never a wait.
    expect: { poll: { timeout: 10_000 } },
  },
});
