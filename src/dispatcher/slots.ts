// A replica's slots for one kind: at most `size` operations in hand at once (WORKER_CONCURRENCY). Jobs
// fetched beyond the free slots wait here, in fetch order, unclaimed.
export class Slots {
  private free: number;
  private readonly waiting: (() => void)[] = [];

  constructor(size: number) {
    this.free = size;
  }

  /** Resolves once a slot is this caller's; release() gives it back. */
  async take(): Promise<void> {
    if (this.free > 0) {
      this.free--;
      return;
    }
    await new Promise<void>((resolve) => this.waiting.push(resolve));
  }

  release(): void {
    const next = this.waiting.shift();
    if (next) next();
    else this.free++;
  }
}
