// The errors outboxd's callers catch by class, in one leaf module: every layer throws them, none owns them.
import type { OperationStatus } from './status.ts';

/** Input refused before anything was written; `field` names what was wrong. */
export class ValidationError extends Error {
  override name = 'ValidationError';
  readonly field: string;
  /** The message without the field's name, for callers that name the field their own way (the CLI's flags). */
  readonly detail: string;
  constructor(field: string, message: string) {
    super(`${field}: ${message}`);
    this.field = field;
    this.detail = message;
  }
}

export class OperationNotFoundError extends Error {
  override name = 'OperationNotFoundError';
  readonly operationId: string;
  constructor(operationId: string) {
    super(`no payment operation ${operationId}`);
    this.operationId = operationId;
  }
}

/** The caller's fencing token is no longer the operation's: another claim took it over, or it settled. */
export class StaleFenceError extends Error {
  override name = 'StaleFenceError';
  readonly operationId: string;
  readonly fence: number;
  readonly currentFence: number | undefined;
  readonly currentStatus: OperationStatus | undefined;
  constructor(operationId: string, fence: number, currentFence?: number, currentStatus?: OperationStatus) {
    super(
      `operation ${operationId}: write with fence ${fence} rejected (current fence ${currentFence}, status ${currentStatus})`,
    );
    this.operationId = operationId;
    this.fence = fence;
    this.currentFence = currentFence;
    this.currentStatus = currentStatus;
  }
}
